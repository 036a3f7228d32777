"""What a run leaves behind and how it survives: the run folder, which run a folder holds and
resume, preemption, the output channel, the host-memory settings of a rank's process, the
test-only fault injection, and ending a rank's process."""
