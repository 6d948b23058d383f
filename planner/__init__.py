"""The planner: memory and step time of a training layout, predicted from the textbook's cost formulas.

    python -m planner --help
"""
