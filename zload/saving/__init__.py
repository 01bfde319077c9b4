"""Saving: the file layout every rank computes (``plan``), the writes (``writer``), the folder a
save owns and commits into (``folder``), and ``save`` and ``convert`` that run those steps.
"""
