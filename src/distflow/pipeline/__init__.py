"""Role-split ranks (pipeline.mode=split): trainer ranks train while rollout ranks generate later steps.

distflow.distributed.roles splits the ranks and their groups; `links` carries messages between the
roles, `weights` the versioned weights; `remote` is the trainers' rollout (groups received, not
generated), `rollout_rank` the loop a rollout rank runs, and `schedule` the staged schedule both
sides follow.
"""
