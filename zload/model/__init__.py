"""The model: what each of its tensors needs (``targets``), which checkpoint bytes make it
(``names``), and building it with parameters born partitioned (``init``, ``ds_config``).
"""
