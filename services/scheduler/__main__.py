from services.scheduler.app import main

main()
