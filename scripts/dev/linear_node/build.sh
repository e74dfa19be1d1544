#!/usr/bin/env bash
# Builds the one-node Linear prototype (linear.cpp) against the environment's torch, CPU only,
# into /tmp/linear_node/proto.so; bench.py measures it (issue 40's design record:
# docs/bench/train/issue40-linear-node.md). A measurement tool, not part of the product.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p /tmp/linear_node
read -r inc lib abi < <(python3 -c "
import torch, os, torch.utils.cpp_extension as E
print(' '.join('-I' + p for p in E.include_paths()).replace(' ', ','), os.path.dirname(torch.__file__) + '/lib',
      int(torch._C._GLIBCXX_USE_CXX11_ABI))")
g++ -shared -fPIC -O2 -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" ${inc//,/ } "$here/linear.cpp" \
  -o /tmp/linear_node/proto.so -L"$lib" -ltorch -ltorch_cpu -lc10 -Wl,-rpath,"$lib"
echo /tmp/linear_node/proto.so
