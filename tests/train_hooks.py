"""
train.py in a real process with one test hook applied first. train.py has no debug switches, so a test that
must reach inside a run (a signal at a given optimizer step, an expert no token reaches, what each rank saw)
patches the model's or the optimizer's internals by name here, then runs train.py as `python train.py` would:

    TRAIN_HOOK=signals python tests/train_hooks.py ARGS...    (or as torchrun's script: one process per rank)

ARGS are train.py's own command line; conftest.run_train_process(args, cwd, hook='signals', ...) builds it.
The hooks that record write what they saw to the folder DUMP as rank{RANK}.pt or .json when the run ends.
"""
import atexit
import json
import os
import runpy
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = REPO  # train.py's imports resolve as for `python train.py`, not from this tests/ folder

import torch  # noqa: E402

RANK = os.environ.get('RANK', '0')  # torchrun's; a lone process is rank 0


def dump_path(suffix):
    return os.path.join(os.environ['DUMP'], f'rank{RANK}.{suffix}')


def signals():
    """At the HOOK_STEP-th optimizer step of rank HOOK_RANK (default 0), HOOK_ACTION: the signals named, sent
    to this process one after the other ('SIGTERM', 'SIGINT SIGINT', 'SIGKILL'), or 'stall' (sleep 10 min).
    HOOK_SAVE_SIGNALS=1: every checkpoint write (torch.save) also sends this process SIGTERM and SIGUSR1
    halfway through."""
    hook_rank = int(os.environ.get('HOOK_RANK', '0'))
    action, at, calls = os.environ['HOOK_ACTION'], int(os.environ['HOOK_STEP']), [0]
    step, save = torch.optim.AdamW.step, torch.save

    def hooked_step(self, *a, **k):
        calls[0] += 1
        if int(RANK) == hook_rank and calls[0] == at:
            if action == 'stall':
                time.sleep(600)
            for name in action.split():
                os.kill(os.getpid(), getattr(signal, name))
        return step(self, *a, **k)

    def save_with_signals(obj, f, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        save(obj, f, *a, **k)
        os.kill(os.getpid(), signal.SIGUSR1)
    torch.optim.AdamW.step = hooked_step
    if os.environ.get('HOOK_SAVE_SIGNALS'):
        torch.save = save_with_signals


def starved_expert():
    """Every MoE layer's last expert starved (its router logit pushed down by 1e4); the first step's
    gradients and the parameters after it recorded."""
    import model as M
    rec, init, step = {}, M.MoE.__init__, torch.optim.AdamW.step

    def starved(self, config):
        init(self, config)
        self.router.register_forward_hook(lambda mod, inp, out: out - 1e4 * (torch.arange(out.size(-1)) ==
                                                                             out.size(-1) - 1))

    def first_step(self, *a, **k):
        out = step(self, *a, **k)
        if 'grads' not in rec:
            params = [p for g in self.param_groups for p in g['params']]
            rec['grads'] = [p.grad.clone() for p in params]
            rec['after'] = [p.detach().clone() for p in params]
        return out
    M.MoE.__init__, torch.optim.AdamW.step = starved, first_step
    return lambda: torch.save(rec, dump_path('pt'))


def loop_draws():
    """Every loop count this rank draws (GPTConfig.draw_n_loop), in order."""
    import model as M
    draws, draw = [], M.GPTConfig.draw_n_loop

    def rec(self, generator):
        draws.append(draw(self, generator))
        return draws[-1]
    M.GPTConfig.draw_n_loop = rec

    def finish():
        with open(dump_path('json'), 'w') as f:
            json.dump(draws, f)
    return finish


def ddp_parity():
    """The training micro-batches, the eval exit statistics, the first step's gradients and the parameters
    before it, the eval statistics before it, and the number of checkpoint saves."""
    import model as M
    from run import checkpoint
    rec = {'train': [], 'eval': [], 'saves': 0, 'models': []}
    forward, exit_metrics, init, save, step = (M.GPT.forward, M.GPT.exit_metrics, M.GPT.__init__,
                                              checkpoint.save, torch.optim.AdamW.step)

    def rec_forward(self, idx, targets=None, n_loop=None):
        if self.training and targets is not None:
            rec['train'].append((idx.clone(), targets.clone()))
        return forward(self, idx, targets, n_loop)

    def rec_exit_metrics(self, idx, targets, n_loop=None):
        ce, norms, router = exit_metrics(self, idx, targets, n_loop)
        if not self.training:
            rec['eval'].append((ce.clone(), norms.clone()))
        return ce, norms, router

    def rec_init(self, *a, **k):
        init(self, *a, **k)
        rec['models'].append(self)

    def rec_save(obj, path):
        rec['saves'] += 1
        return save(obj, path)

    def rec_step(self, *a, **k):
        if 'grads' not in rec:
            m = rec['models'][-1]
            rec['grads'] = {n: p.grad.clone() for n, p in m.named_parameters()}
            rec['params'] = {n: p.detach().clone() for n, p in m.named_parameters()}
            rec['first_eval'] = list(rec['eval'])
        return step(self, *a, **k)
    M.GPT.forward, M.GPT.exit_metrics, M.GPT.__init__ = rec_forward, rec_exit_metrics, rec_init
    checkpoint.save, torch.optim.AdamW.step = rec_save, rec_step
    return lambda: torch.save({k: rec.get(k) for k in ('train', 'grads', 'params', 'first_eval', 'saves')},
                              dump_path('pt'))


def denormals_at_exit():
    """Prints 1e-20 ** 2 as the process ends (an exit handler: train.py may sys.exit), 0.0 once fp32
    denormals count as zero; asserts they did not before train.py."""
    x = torch.tensor([1e-20])
    assert (x * x).item() > 0  # on before train.py
    atexit.register(lambda: print('after train.py: 1e-20 ** 2 =', (x * x).item()))


HOOKS = {hook.__name__: hook for hook in (signals, starved_expert, loop_draws, ddp_parity, denormals_at_exit)}

if __name__ == '__main__':
    finish = HOOKS[os.environ['TRAIN_HOOK']]()
    sys.argv = ['train.py'] + sys.argv[1:]
    try:
        runpy.run_path(os.path.join(REPO, 'train.py'), run_name='__main__')
    finally:
        if finish is not None:
            finish()
