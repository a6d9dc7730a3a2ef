from marl.proxy.cli import main

main()
