"""`python -m launcher.chat MODEL [QUESTION] --image FILE`: the name LLaMA-Factory's users type for
`python -m launcher.infer` (the same program: launcher.infer.infer)."""
