"""The engine the mixing methods stand on (the methods themselves are in :mod:`mixhook.mixers`).

Read one training forward as data travels, one module per hop:

- :mod:`.path`: the hooks a mixer registers (:class:`~.path.Path`): the model's pre-hook decides, the
  mixed layer's hook hands its output to the one path every method's mix walks (``Path._mix``: its
  leaves, the draws, the method's ``mix``, the record; a plain tensor with its site's planned signature is
  the cheap case, chosen at its top), the model's output hook marks the output;
- :mod:`.mixer`: :class:`~.mixer.Mixer`, the base a method subclasses: what it implements (``mix``,
  ``sample_lam``, ``draw_index``, ``check_leaves``, ...) and what a user calls (``pin``, ``use``, ...);
- :mod:`.forward`: that forward as one object (:class:`~.forward.Forward`: layer, pins, lam and the index
  as drawn, what it mixed) and what a user pinned for it (:class:`~.forward.Pins`);
- :mod:`.leaves`: a site's leaves as the method is given them (:class:`~.leaves.SiteLeaves`: batch
  dimensions, layouts, token grids; a plain output planned at its first forward, with the signature it was
  derived from: :class:`~.leaves.Plan`);
- :mod:`.contract`: what a method is given and returns (:class:`~.contract.Draw`,
  :class:`~.contract.Mixed`), what a mix did (:class:`~.contract.MixState`), and the contract a training
  loop relies on (:class:`~.contract.MixingHook`);
- :mod:`.binding`: which forward produced given logits (:class:`~.binding.Forwards`);
- :mod:`.targets`: ``loss()`` and ``targets()`` from a forward's :class:`~.contract.MixState`.

Beside the path, each in its own module: padding masks downstream of a mix (:mod:`.padding_masks`), the
gradient pass of the gradient-saliency methods (:mod:`.gradient_pass`), the one-graph path under
``torch.compile`` (:mod:`.traced`), the bases of the region methods (:mod:`.regions`: layouts, tokens as
maps, one mask function for the eager and the compiled mix), patch tokens as maps (:mod:`.tokens`), saliency
sources (:mod:`.saliency`), partners from every rank's batch
(:mod:`.partners`), the policies a mixer uses (:mod:`.policies`: partners, lam, targets) and the checks
the methods share (:mod:`.checks`). Activation-checkpoint replay is
:mod:`mixhook.recompute`.
"""
