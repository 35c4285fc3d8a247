from megamoe.bench.cli import main

main()
