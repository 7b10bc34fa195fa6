"""Helpers every package needs, in one place: they import nothing but the standard library.

They live under `artifacts/` because the root folders are fixed by the design and `artifacts` is the
package every stage already depends on for its errors; nothing here imports a stage.
"""
