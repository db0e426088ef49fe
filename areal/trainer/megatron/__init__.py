"""The Megatron-Core trainer backend (trainer.backend=megatron).

    HF dir --weights_io.load_hf--> GPTModel (model.py; TP/PP shards)
                                      |  --weights_io.save_hf--> weights/vN/, checkpoints
                                      |  (convert.py: HF <-> Megatron names, TP slices, PP stages)
    backend.MegatronBackend: trainer/backend.py's TrainerBackend, for trainer/step.py;
        pp > 1 through pipeline.py (CPU, GPipe) or gpu.py (Megatron's 1F1B schedule)

Imported only when the config asks for it, so the torch backend never pays for megatron.
"""
