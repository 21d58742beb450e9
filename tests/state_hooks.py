"""torch.optim's four state-dict hooks on an optimizer: what runs, in which order, and
whether what they return is used (``distopt.surface`` runs them for distopt's optimizers)."""
from typing import Any, List, Tuple


def hooks_seen(opt: Any) -> Tuple[List[str], Any, List[str], str]:
    """Register the four hooks on ``opt``, call ``state_dict`` and ``load_state_dict``:
    (the calls in order, the post-hook's mark as the state_dict holds it, its keys, and
    the refusal of ``add_param_group``)."""
    calls: List[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(
        lambda o, sd: (calls.append("post"), {**sd, "note": "post"})[1])
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: (calls.append("load_pre"),
                       {k: v for k, v in sd.items() if k != "note"})[1])
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    try:
        opt.add_param_group({"params": []})
        refusal = "accepted"
    except NotImplementedError as error:
        refusal = str(error)
    return calls, sd.get("note"), sorted(sd), refusal
