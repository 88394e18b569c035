from .cli.demo import main

main()
