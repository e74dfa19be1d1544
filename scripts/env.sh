# Sourced by the scripts: the project's Python environment (created by scripts/setup).
# TORCHFUSE_VENV overrides where it lives; the default is outside the work tree so a fresh
# clone (CI) reuses it on the same machine.
TORCHFUSE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCHFUSE_TORCH_VERSION=2.11.0
# The transformers the GPU machine has: the rewrite layer's CPU tests read its model code.
TORCHFUSE_TRANSFORMERS_VERSION=5.17.0
# The launcher's test of `torchfuse accelerate launch` (tests/python/test_cli.py).
TORCHFUSE_ACCELERATE_VERSION=1.15.0
# Layer graphs' LoRA and ViT tests (tests/python/test_layer_graphs.py): PEFT's LoRA Linear, timm's
# ViT block (timm needs torchvision: the one built for this torch).
TORCHFUSE_PEFT_VERSION=0.21.2
TORCHFUSE_TIMM_VERSION=1.0.31
TORCHFUSE_TORCHVISION_VERSION=0.26.0
TORCHFUSE_VENV="${TORCHFUSE_VENV:-$HOME/.cache/torchfuse/venv-torch$TORCHFUSE_TORCH_VERSION}"
export TORCHFUSE_ROOT TORCHFUSE_VENV

# libtorch's folder first on LD_LIBRARY_PATH (cargo's test binaries link it); the project's
# Python environment must be active.
export_torch_lib_path() {
  local torch_lib
  torch_lib="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
