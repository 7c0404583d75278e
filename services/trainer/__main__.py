from services.trainer.app import main

main()
