"""`larql bench`: whole-token decode timing, memory and roofline of every engine, with HF
transformers as a peer measured in the same run."""
