from trainer.cli import main

main()
