from services.rollout.app import main

main()
