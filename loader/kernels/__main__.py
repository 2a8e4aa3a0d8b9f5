"""``python -m loader.kernels``: build the compiled expert kernels (``make setup`` runs it)."""

import sys

from loader.kernels import main

sys.exit(main(sys.argv[1:]))
