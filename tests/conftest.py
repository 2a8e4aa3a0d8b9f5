"""Make the repository root importable: the package is not pip-installed in the test environment."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
