from petctl.cli import main

main()
