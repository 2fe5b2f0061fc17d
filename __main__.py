from mixq.cli import main

main()
