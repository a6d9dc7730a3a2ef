"""A server of several LoRA policies of one base: one `TrainableServer` per policy (`server`) on views of one shared
engine and trainer (`views`), its frozen past policies (`frozen`), and adapter files read safely (`adapter_files`)."""
