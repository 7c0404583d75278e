from services.weightsync.app import main

main()
