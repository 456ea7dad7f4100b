"""``python -m boost_compile.bench``: the same as ``boost-bench``."""

import sys

from boost_compile.bench.cli import main

sys.exit(main())
