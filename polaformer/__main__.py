"""Entry point for ``python -m polaformer``."""
import sys

from polaformer.cli import main

sys.exit(main())
