"""torch.optim's four state-dict hooks on an optimizer: what runs, in which order, and
whether what they return is used (``distopt.surface`` runs them for distopt's optimizers)."""
from typing import Any, List, Tuple


def hooks_seen(opt: Any) -> Tuple[List[str], Any, List[str], str]:
    """Register the four hooks on ``opt``, call ``state_dict`` and ``load_state_dict``:
    (the calls in order, each marked where a hook was handed another object than ``opt``,
    the post-hook's mark as the state_dict holds it, its keys, and the refusal of
    ``add_param_group``)."""
    calls: List[str] = []

    def seen(name: str, o: Any) -> None:
        """Each hook is handed the optimizer itself, as torch.optim hands it."""
        calls.append(name if o is opt else f"{name} (handed a {type(o).__name__})")

    opt.register_state_dict_pre_hook(lambda o: seen("pre", o))
    opt.register_state_dict_post_hook(
        lambda o, sd: (seen("post", o), {**sd, "note": "post"})[1])
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: (seen("load_pre", o),
                       {k: v for k, v in sd.items() if k != "note"})[1])
    opt.register_load_state_dict_post_hook(lambda o: seen("load_post", o))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    try:
        opt.add_param_group({"params": []})
        refusal = "accepted"
    except NotImplementedError as error:
        refusal = str(error)
    return calls, sd.get("note"), sorted(sd), refusal
