from megamoe.bench.layer import main

main()
