"""The update side: the `Learner` (policy, reference, critic and updater as one component), the
padded batch, the FSDP2 policy and critic, reward shaping, their forward and loss passes, the LM
head's chunked logprobs, the replicas' gradient reducer, LoRA adapters, model start-up, and the
weight stream that resyncs the engine after an update."""
