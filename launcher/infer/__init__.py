"""`python -m launcher.infer MODEL [QUESTION] --image FILE`: ask a trained model (launcher.infer.infer)."""
