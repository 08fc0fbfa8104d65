"""`python -m petctl`: the same command line as `petctl`."""

from petctl.cli import main

main()
