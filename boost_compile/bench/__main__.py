import sys

from boost_compile.bench.cli import main

sys.exit(main())
