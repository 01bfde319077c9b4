"""Loading: plan the reads (``plan``), agree across ranks before writing (``agree``), perform them
from local files, peer ranks or the slow path (``execute``, ``peers``, ``slow_path``), and the
``load_into`` that runs those steps.
"""
