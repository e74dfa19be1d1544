"""`python -m torchfuse` (and the `torchfuse` command): see torchfuse.cli."""
import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
