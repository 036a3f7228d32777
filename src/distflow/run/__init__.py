"""What a run leaves behind and how it survives: the run folder, checkpoints and resume,
preemption, export, the output channel, metric loggers, the step report and plots."""
