from rollsafe.cli.app import main

main()
