"""The no-code Trainyard dashboard (Streamlit). Run it with `streamlit run dashboard/app.py`.

It talks to the platform only through the Python SDK (`trainyard.Client`): gRPC to the scheduler and the rollout.
"""
