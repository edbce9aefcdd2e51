"""Training LoRA adapters for the fleet's models (`appliance distill train`): the examples, the
plan of a run, the trainer's own process, and the job that runs it and registers the result.
Only worker.py imports the training stack (torch, peft, transformers); it runs in its own process."""
