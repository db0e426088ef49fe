"""The Megatron-Core trainer backend (trainer.backend=megatron).

    HF dir --convert.load_hf--> GPTModel (model.py; TP/PP shards) --convert.save_hf--> weights/vN/
                                      |
                    backend.MegatronBackend: logprobs / optimizer_step for trainer/step.py

Imported only when the config asks for it, so the torch backend never pays for megatron.
"""
