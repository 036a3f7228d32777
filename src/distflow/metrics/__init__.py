"""Metrics: the step report that turns a step's records into metric keys (report), the loggers
rank 0 writes them to: console, jsonl, wandb, tensorboard (loggers), the training curves (plot),
and the phase timer with the observers that watch a run from outside its loop (timer)."""
