#!/usr/bin/env bash
# The installed attnserve as a user gets it (tests/install/CMakeLists.txt):
#   install_test.sh BUILD_DIR SOURCE_DIR VERSION
# 1. cmake --install BUILD_DIR into a temporary prefix; the files a user needs are there.
# 2. The installed server says the project's VERSION.
# 3. tests/install/consumer, a CMake project that knows only the prefix, configures with
#    find_package(attnserve_client), builds, and runs against the installed server on loopback.
set -euo pipefail
build=$1 src=$2 version=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/attnserve-install.XXXXXX")
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "install_test: FAIL: $*" >&2; exit 1; }

prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" > "$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
for f in bin/attnserve bin/attnserve-cli lib/libattnserve_client.a lib/libattnserve_proto.a \
  include/attnserve/client/client.h include/attnserve/client/npy.h \
  include/attnserve/attnserve/v1/attention.pb.h include/attnserve/attnserve/v1/attention.grpc.pb.h \
  lib/cmake/attnserve_client/attnserve_clientConfig.cmake \
  lib/cmake/attnserve_client/attnserve_clientConfigVersion.cmake \
  lib/cmake/attnserve_client/attnserve_clientTargets.cmake share/doc/attnserve/LICENSE; do
  [[ -e $prefix/$f ]] || fail "cmake --install left out $f"
done
got=$("$prefix/bin/attnserve" --version)
[[ $got == "attnserve $version" ]] || fail "installed attnserve --version says '$got', expected 'attnserve $version'"

# The consumer sees only the prefix: no path into the source or build tree.
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=$tmp  # the prefix's path differs each run; relative paths hit the cache
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cp -r "$src/tests/install/consumer" "$tmp/consumer"
cmake -S "$tmp/consumer" -B "$tmp/consumer-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" > "$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "find_package(attnserve_client) against the installed prefix"; }
grep -rq -- "$src\|$build" "$tmp/consumer-build/build.ninja" && fail "the consumer's build names the source or build tree"
cmake --build "$tmp/consumer-build" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building the consumer"; }

"$prefix/bin/attnserve" --listen 127.0.0.1:0 --port-file "$tmp/port" --metrics-listen 127.0.0.1:0 \
  --layer probe=random:d_model=96,heads=6,seed=3 --threads 1 > "$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 600); do
  [[ -s $tmp/port ]] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$tmp/server.log"; fail "the installed server did not start"; }
  sleep 0.1
done
[[ -s $tmp/port ]] || fail "the installed server wrote no port in 60 s"
"$tmp/consumer-build/consumer" "127.0.0.1:$(cat "$tmp/port")" probe || fail "the consumer against the installed server"
"$prefix/bin/attnserve-cli" --target "127.0.0.1:$(cat "$tmp/port")" health | grep -qx SERVING ||
  fail "the installed attnserve-cli health"
echo "install_test: ok"
