from marl.cli import main

main()
