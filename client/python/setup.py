"""Builds the attnserve package: the version from the project's CMakeLists.txt and the gRPC stubs
of proto/attnserve/v1/attention.proto, generated into attnserve/v1/ when the package is built.

The stubs come from grpcio-tools' protoc when it is importable (pip's isolated build installs it,
pyproject.toml), else from `protoc` and `grpc_python_plugin` on PATH (Debian's
protobuf-compiler-grpc: stubs that match Debian's python3-grpcio and python3-protobuf, for
`pip install --no-build-isolation`)."""
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO = "attnserve/v1/attention.proto"


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(attnserve\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if m is None:
        sys.exit("setup.py: no `project(attnserve VERSION x.y.z` in the top CMakeLists.txt")
    return m.group(1)


def generate_stubs(out_dir):
    """attention_pb2.py and attention_pb2_grpc.py under out_dir/attnserve/v1/."""
    if not os.path.exists(os.path.join(PROTO_DIR, PROTO)):
        sys.exit(f"setup.py: {PROTO_DIR}/{PROTO} is missing: build the package from the attnserve repository")
    args = [f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", os.path.join(PROTO_DIR, PROTO)]
    try:
        from grpc_tools import protoc
    except ImportError:
        protoc_bin, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if protoc_bin is None or plugin is None:
            sys.exit("setup.py: neither grpcio-tools nor protoc and grpc_python_plugin (Debian's "
                     "protobuf-compiler-grpc) are available to generate the gRPC stubs")
        subprocess.run([protoc_bin, f"--plugin=protoc-gen-grpc_python={plugin}", *args], check=True)
    else:
        import importlib.resources
        include = str(importlib.resources.files("grpc_tools") / "_proto")
        if protoc.main(["protoc", f"-I{include}", *args]) != 0:
            sys.exit(f"setup.py: grpc_tools.protoc failed on {PROTO}")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)
        with open(os.path.join(self.build_lib, "attnserve", "v1", "__init__.py"), "w"):
            pass
        with open(os.path.join(self.build_lib, "attnserve", "_version.py"), "w") as f:
            f.write(f'__version__ = "{project_version()}"\n')


setup(version=project_version(), cmdclass={"build_py": BuildPyWithStubs})
