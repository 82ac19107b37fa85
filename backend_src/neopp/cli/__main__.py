"""``python -m neopp.cli``: the same as the ``neopp`` console script."""

from neopp.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
