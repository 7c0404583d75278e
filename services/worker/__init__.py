"""The worker room: the Celery task a worker process runs (app.py), the claim / heartbeat / finish shell around a
managed job (job.py), and one recipe per job method (recipes/: what a job of that method trains, through the training
engine). The scheduler only sends task names; it never imports this package."""
