"""The fleet: how many engines and workers run, where, and which episode goes to whom (elastic
fleet, autoscaling policy, dispatcher, room check, worker logs)."""
