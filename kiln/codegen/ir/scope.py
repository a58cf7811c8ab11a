"""Generated code as nested scopes, shared by the emitters."""


class Scope:
    """Lines of code at one loop depth and the values computed there (``find`` looks outwards). What a
    line holds beyond strings is the emitter's: a nested block refers to the Scope of its body."""

    def __init__(self, parent=None, lines=()):
        self.parent, self.lines, self.cache = parent, list(lines), {}

    def find(self, key):
        s = self
        while s is not None:
            if key in s.cache:
                return s.cache[key]
            s = s.parent
        return None
