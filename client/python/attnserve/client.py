"""attnserve.Client: one gRPC channel to an attnserve server, numpy arrays in and out.

Thread-safety: a Client may be used from several threads at once (gRPC channels and stubs are
thread-safe); close() it, or use it as a context manager, when done.
"""
import dataclasses
import json
from typing import Dict, List, Mapping, Optional, Sequence, Union

import grpc
import numpy as np

try:
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - an unbuilt source tree
    raise ImportError(f"{e}: attnserve's gRPC stubs are generated when the package is built; install it with "
                      "`pip install ./client/python` from the attnserve repository") from None

# A form's name is its attnserve.v1.Form name without "FORM_", in lower case ("summed"): the
# proto's enum is the one list of forms, so a form the server adds is known here from the stubs.
_FORM_NAMES = {number: name[len("FORM_"):].lower() for name, number in pb.Form.items()}
_FORMS = {name: number for number, name in _FORM_NAMES.items() if number != pb.FORM_UNSPECIFIED}

PathOrBytes = Union[str, bytes, None]


class AttnserveError(Exception):
    """A call the server (or gRPC) answered with a status other than OK.

    `code` is the grpc.StatusCode, `code_name` its name ("INVALID_ARGUMENT") and `details` the
    server's message, which names the field, what was expected and what came."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str):
        self.method = method
        self.code = code
        self.code_name = code.name if code is not None else "UNKNOWN"
        self.details = details or ""
        super().__init__(f"{method}: {self.code_name}: {self.details}")


@dataclasses.dataclass(frozen=True)
class Divergence:
    max_abs: float  # max |other - served|
    rel_l2: float   # ||other - served|| / ||served||


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    output: np.ndarray                 # float32, the input's shape ([batch, n, d_model] or [n, d_model])
    form: str                          # the form that computed it: factored, summed or lowrank
    queue_us: int
    compute_us: int
    batch_requests: int
    decode_us: int
    encode_us: int
    divergence: Dict[str, Divergence]  # with compare: one per other form held in the served math
    math: str = ""                     # the math it ran in: fp32, tf32, bf16 or fp16


@dataclasses.dataclass(frozen=True)
class FormInfo:
    parameters: int
    bytes: int
    device: str
    flops_per_token: float
    flops_reference_length: int
    ranks: List[int]        # lowrank only
    rank_selection: str     # lowrank only
    kept_energy: float      # lowrank only
    # lowrank only, per head: the share of its energy kept; and with divergence:EPS its output
    # divergence on the calibration rows, the layer's, and how many rows (docs/spectra.md)
    head_kept_energy: List[float] = dataclasses.field(default_factory=list)
    head_divergence: List[float] = dataclasses.field(default_factory=list)
    calibration_divergence: float = 0.0
    calibration_rows: int = 0


@dataclasses.dataclass(frozen=True)
class HeadSpectrum:
    singular_values: np.ndarray  # float64, descending
    frobenius: float
    stable_rank: float
    effective_rank: float
    rank_90: int
    rank_99: int
    rank_999: int


@dataclasses.dataclass(frozen=True)
class Spectrum:
    ov: List[HeadSpectrum]  # per query head: W_V_g(i) W_O_i
    qk: List[HeadSpectrum]  # per query head: W_Q_i W_K_g(i)^T

    def singular_values(self, which: str = "ov") -> np.ndarray:
        """[heads, k] float64: every head's singular values of the OV ("ov") or QK ("qk") product."""
        heads = {"ov": self.ov, "qk": self.qk}.get(which)
        if heads is None:
            raise ValueError(f"which: expected 'ov' or 'qk', got {which!r}")
        return np.stack([h.singular_values for h in heads]) if heads else np.zeros((0, 0))


@dataclasses.dataclass(frozen=True)
class LiveCalibration:
    """A low-rank form calibrated on live traffic (calibration=live:ROWS), before it is built."""
    rank_selection: str  # "divergence:EPS"
    rows_wanted: int
    rows_seen: int
    error: str           # the build's failure; empty while gathering or building


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    name: str
    source: str
    d_model: int
    heads: int
    kv_heads: int
    d_head: int
    bias: bool
    scale: float
    rope_theta: float
    forms: Dict[str, FormInfo]
    spectrum: Optional[Spectrum]  # only from layer(name, spectrum=True) / spectrum(name)
    live_calibration: Optional[LiveCalibration] = None
    maths: List[str] = dataclasses.field(default_factory=list)  # every form is held in each; the default first


@dataclasses.dataclass(frozen=True)
class Routing:
    routes: Dict[str, Dict[str, float]]  # layer (or "*", the default) -> form -> share
    shadow_rate: float


def _read(what: str, value: PathOrBytes) -> Optional[bytes]:
    """PEM bytes from bytes as they are, or from a file path."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {value!r}: {e.strerror}") from None


def _tensor(name: str, a, batched: bool) -> "pb.Tensor":
    a = np.asarray(a)
    if a.dtype == np.float16:
        dtype, data = pb.DATA_TYPE_FLOAT16, a.astype("<f2")
    elif a.dtype in (np.float32, np.float64):
        dtype, data = pb.DATA_TYPE_FLOAT32, a.astype("<f4")  # float64 is rounded to float32
    else:
        raise TypeError(f"{name}: expected a float32, float16 or float64 array, got dtype {a.dtype}")
    want = 3 if batched else 2
    if a.ndim != want:
        layout = "[batch, rows, d_model]" if batched else "[rows, d_model] (x is 2-D)"
        raise ValueError(f"{name}: expected {want} dimensions {layout}, got shape {list(a.shape)}")
    return pb.Tensor(dtype=dtype, shape=list(a.shape) if batched else [1, *a.shape],
                     data=np.ascontiguousarray(data).tobytes())


def _form(value: Optional[str]) -> int:
    if value is None:
        return pb.FORM_UNSPECIFIED
    if value not in _FORMS:
        raise ValueError(f"form: expected one of {', '.join(_FORMS)} or None (the server's route), got {value!r}")
    return _FORMS[value]


def _head_spectrum(h) -> HeadSpectrum:
    return HeadSpectrum(np.array(h.singular_values, dtype=np.float64), h.frobenius, h.stable_rank, h.effective_rank,
                        h.rank_90, h.rank_99, h.rank_999)


def _layer_info(info, with_spectrum: bool) -> LayerInfo:
    c = info.config
    forms = {_FORM_NAMES.get(f.form, str(f.form)): FormInfo(f.parameters, f.bytes, f.device, f.flops_per_token,
                                                            f.flops_reference_length, list(f.ranks), f.rank_selection,
                                                            f.kept_energy, list(f.head_kept_energy),
                                                            list(f.head_divergence), f.calibration_divergence,
                                                            f.calibration_rows)
             for f in info.forms}
    spectrum = None
    if with_spectrum:
        spectrum = Spectrum([_head_spectrum(h) for h in info.ov_spectrum],
                            [_head_spectrum(h) for h in info.qk_spectrum])
    live = None
    if info.HasField("live_calibration"):
        lc = info.live_calibration
        live = LiveCalibration(lc.rank_selection, lc.rows_wanted, lc.rows_seen, lc.error)
    return LayerInfo(info.name, info.source, c.d_model, c.heads, c.kv_heads, c.d_head, c.bias, c.scale, c.rope_theta,
                     forms, spectrum, live, list(info.maths))


def _routing(info) -> Routing:
    def target(w) -> str:
        name = _FORM_NAMES.get(w.form, str(w.form))
        return f"{name}@{w.math}" if w.math else name

    return Routing({r.layer: {target(w): w.weight for w in r.weights} for r in info.routes}, info.shadow_rate)


def _encode_health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest {string service = 1} by hand (no health stubs needed)."""
    data = service.encode()
    length, varint = len(data), bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return (b"\x0a" + bytes(varint) + data) if data else b""


_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _decode_health_response(data: bytes) -> str:
    """HealthCheckResponse {ServingStatus status = 1}: absent means UNKNOWN (0)."""
    status, i = 0, 0
    while i < len(data):
        tag = data[i]
        i += 1
        if tag == 0x08:  # field 1, varint
            status, shift = 0, 0
            while True:
                byte = data[i]
                i += 1
                status |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
        else:
            raise ValueError(f"health response: unexpected tag {tag:#x}")
    return _SERVING_STATUS.get(status, str(status))


class Client:
    """A connection to one attnserve server (any gRPC target: "host:port", "dns:///host:port").

    timeout: seconds per call (None: no deadline). TLS: give root_certificates (the CA that signed
    the server's certificate; PEM bytes or a file path), or tls=True to trust the system's roots;
    certificate_chain and private_key present a client certificate (mTLS); server_name overrides
    the name checked against the server's certificate. admin_token is sent, as
    "authorization: Bearer TOKEN", with the admin calls only (load, unload, route)."""

    def __init__(self, target: str = "localhost:50051", *, timeout: Optional[float] = 30.0, tls: bool = False,
                 root_certificates: PathOrBytes = None, certificate_chain: PathOrBytes = None,
                 private_key: PathOrBytes = None, server_name: Optional[str] = None,
                 admin_token: Optional[str] = None, max_message_mb: int = 64, load_balancing: Optional[str] = None,
                 options: Sequence = ()):
        self.target = target
        self.timeout = timeout
        self._admin = (("authorization", f"Bearer {admin_token}"),) if admin_token else None
        opts = list(options)
        if max_message_mb and max_message_mb > 0:
            opts += [("grpc.max_send_message_length", max_message_mb << 20),
                     ("grpc.max_receive_message_length", max_message_mb << 20)]
        if load_balancing:
            opts.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{load_balancing: {}}]})))
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain, private_key: a client certificate needs both, got one")
        if tls or root_certificates is not None or certificate_chain is not None:
            if server_name:
                opts.append(("grpc.ssl_target_name_override", server_name))
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read("root_certificates", root_certificates),
                private_key=_read("private_key", private_key),
                certificate_chain=_read("certificate_chain", certificate_chain))
            self._channel = grpc.secure_channel(target, credentials, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health = self._channel.unary_unary("/grpc.health.v1.Health/Check",
                                                 request_serializer=lambda b: b,
                                                 response_deserializer=lambda b: b)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, admin: bool = False):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout,
                                               metadata=self._admin if admin else None)
        except grpc.RpcError as e:
            raise AttnserveError(method, e.code(), e.details()) from None

    # -- the forward pass ---------------------------------------------------------------------

    def forward(self, layer: str, x, *, form: Optional[str] = None, context=None, causal: bool = False,
                key_lengths: Union[int, Sequence[int], None] = None, request_key: str = "",
                position_offset: int = 0, compare: bool = False, math: str = "") -> ForwardResult:
        """The layer's attention over x: [batch, n, d_model], or [n, d_model] for one sequence
        (the output then has that shape too). float32, float16 (sent as FLOAT16) or float64
        (rounded to float32). form None: the server's route decides; context: cross-attention
        keys and values, [batch, m, d_model] (or [m, d_model]); key_lengths: one per batch row
        (an int for a 2-D x), row b sees keys [0, key_lengths[b]); request_key: the sticky-
        routing key; compare: also run the other held forms and report their divergence; math:
        the math to run in (fp32, tf32, bf16, fp16: one the layer is held in), "" for the
        route's or the layer's default."""
        x_arr = np.asarray(x)
        batched = x_arr.ndim != 2
        request = pb.ForwardRequest(layer=layer, form=_form(form), input=_tensor("x", x_arr, batched),
                                    causal=causal, request_key=request_key, compare=compare,
                                    position_offset=position_offset, math=math)
        if context is not None:
            request.context.CopyFrom(_tensor("context", context, batched))
        if key_lengths is not None:
            lengths = [key_lengths] if np.ndim(key_lengths) == 0 else list(key_lengths)
            request.key_lengths.extend(int(v) for v in lengths)
        response = self._call("Forward", request)
        out = response.output
        shape = list(out.shape)
        count = int(np.prod(shape)) if shape else 0
        if out.dtype != pb.DATA_TYPE_FLOAT32 or len(shape) != 3 or len(out.data) != count * 4:
            raise AttnserveError("Forward", grpc.StatusCode.INTERNAL,
                                 f"output: expected FLOAT32 [batch, n, d_model] with {count * 4} bytes, got dtype "
                                 f"{out.dtype}, shape {shape}, {len(out.data)} bytes")
        y = np.frombuffer(out.data, dtype="<f4").astype(np.float32).reshape(shape)  # a writable copy
        if not batched:
            y = y[0]
        return ForwardResult(y, _FORM_NAMES.get(response.form, str(response.form)), response.queue_us,
                             response.compute_us, response.batch_requests, response.decode_us, response.encode_us,
                             {_FORM_NAMES.get(d.form, str(d.form)): Divergence(d.max_abs, d.rel_l2)
                              for d in response.divergence}, response.math)

    def compare(self, layer: str, x, **kwargs) -> ForwardResult:
        """forward(..., compare=True): the served answer and, in .divergence, how far every other
        form the layer holds lies from it."""
        return self.forward(layer, x, compare=True, **kwargs)

    # -- layers -------------------------------------------------------------------------------

    def layers(self) -> List[LayerInfo]:
        return [_layer_info(info, False) for info in self._call("ListLayers", pb.ListLayersRequest()).layers]

    def layer(self, name: str, *, spectrum: bool = False) -> LayerInfo:
        info = self._call("GetLayer", pb.GetLayerRequest(name=name, include_spectrum=spectrum))
        return _layer_info(info, spectrum)

    def spectrum(self, name: str) -> Spectrum:
        """Per-head OV and QK spectra, computed by the server at load (docs/spectra.md)."""
        return self.layer(name, spectrum=True).spectrum

    def load(self, name: str, source: str) -> LayerInfo:
        """LoadLayer (admin): SOURCE as in docs/sources.md, e.g. "random:d_model=64,heads=4"."""
        return _layer_info(self._call("LoadLayer", pb.LoadLayerRequest(name=name, source=source), admin=True), False)

    def unload(self, name: str) -> None:
        self._call("UnloadLayer", pb.UnloadLayerRequest(name=name), admin=True)

    # -- routing ------------------------------------------------------------------------------

    def route(self, layer: str = "", weights: Optional[Mapping[str, float]] = None, *,
              shadow_rate: Optional[float] = None) -> Routing:
        """SetRouting (admin): route("*", {"factored": 90, "summed": 10}) splits the requests that
        name no form; a key may name the math too, {"factored@bf16": 90, "factored@fp32": 10};
        an empty `weights` removes the layer's route (for "*": back to factored only); layer ""
        with shadow_rate changes the shadow rate alone. Returns the routing now."""
        request = pb.SetRoutingRequest(layer=layer)
        for target, weight in (weights or {}).items():
            if target is None:
                raise ValueError("weights: a form name, got None")
            form, _, math = target.partition("@")
            request.weights.add(form=_form(form), weight=float(weight), math=math)
        if shadow_rate is not None:
            request.shadow_rate = float(shadow_rate)
        return _routing(self._call("SetRouting", request, admin=True))

    def routing(self) -> Routing:
        return _routing(self._call("GetRouting", pb.GetRoutingRequest()))

    # -- health -------------------------------------------------------------------------------

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... for "" (the server), or for
        "attnserve.v1.AttentionService" / "inference.GRPCInferenceService"."""
        try:
            answer = self._health(_encode_health_request(service), timeout=self.timeout)
        except grpc.RpcError as e:
            raise AttnserveError("Health/Check", e.code(), e.details()) from None
        return _decode_health_response(answer)
