"""`python -m pepsi`: the same program as the `pepsi` console script."""

from __future__ import annotations

import sys

from pepsi.cli import main

sys.exit(main())
