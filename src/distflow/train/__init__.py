"""The update side: the padded batch, the FSDP2 policy and critic, their forward and loss passes,
the LM head's chunked logprobs, the replicas' gradient reducer, LoRA adapters and model start-up."""
