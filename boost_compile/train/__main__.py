"""``python -m boost_compile.train``: the same as ``boost-train``."""

from boost_compile.train.app import main

if __name__ == "__main__":
    main()
