"""Encoders: loading and pooling, the from-scratch student, MoE layers, model cards."""
