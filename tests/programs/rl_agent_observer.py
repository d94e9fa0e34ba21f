"""Reinforcement learning with one agent and several observers.

The agent on worker0 holds the policy. Each observer (worker1, worker2, ...) runs a small
deterministic environment and, at every step, asks the agent for an action and reports
its reward, through RRefs to the agent (``_remote_method`` on ``agent_rref.owner()``).
After each episode the agent makes a policy-gradient (REINFORCE) update.

Result: the total reward per episode, the final parameters and their checksum, and the
observers' names and worker ids.
"""

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
from torch.distributions import Categorical

WORLD_SIZE = 3
AGENT_NAME = "worker0"
OBSERVER_NAME = "worker{}"
LINE = 7  # cells of the environment
EPISODES = 6
STEPS = 10
GAMMA = 0.9
LR = 0.05


def _call_method(method, rref, *args, **kwargs):
    """Call ``method`` on the object ``rref`` holds; runs on the owner."""
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    """Call ``method`` on the object ``rref`` holds, wherever it lives, and wait."""
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class LineWorld:
    """A walk on a line toward a goal cell: +1 for a step closer, -1 for a step away,
    +5 for reaching it. The start changes each episode, deterministically."""

    def __init__(self, size, seed):
        self.size = size
        self.seed = seed
        self.episode = 0
        self.goal = size - 1 if seed % 2 else 0
        self.pos = 0

    def state(self):
        s = torch.zeros(2 * self.size)
        s[self.pos] = 1.0
        s[self.size + self.goal] = 1.0
        return s

    def reset(self):
        self.episode += 1
        self.pos = (3 * self.seed + 2 * self.episode) % self.size
        if self.pos == self.goal:
            self.pos = self.size // 2
        return self.state()

    def step(self, action):
        before = abs(self.goal - self.pos)
        self.pos = min(max(self.pos + (1 if action == 1 else -1), 0), self.size - 1)
        after = abs(self.goal - self.pos)
        done = after == 0
        reward = 5.0 if done else (1.0 if after < before else -1.0)
        return self.state(), reward, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(2 * LINE, 16)
        self.affine2 = nn.Linear(16, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.affine1(x))), dim=1)


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = LineWorld(LINE, seed=self.id)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self, world_size):
        torch.manual_seed(0)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=LR)
        self.agent_rref = RRef(self)
        self.ob_rrefs = []
        self.rewards = {}
        self.saved_log_probs = {}
        self.generators = {}
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []
            # one generator per observer: observers call concurrently, so a shared random
            # stream would hand out samples in arrival order
            self.generators[ob_info.id] = torch.Generator().manual_seed(ob_info.id)

    def select_action(self, ob_id, state):
        probs = self.policy(state.unsqueeze(0))
        action = torch.multinomial(probs[0], 1, generator=self.generators[ob_id])
        self.saved_log_probs[ob_id].append(Categorical(probs[0]).log_prob(action[0]))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps):
        futs = [rpc_async(ob_rref.owner(), _call_method,
                          args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
                for ob_rref in self.ob_rrefs]
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        log_probs, returns, total = [], [], 0.0
        for ob_id in sorted(self.rewards):
            R, ob_returns = 0.0, []
            for r in reversed(self.rewards[ob_id]):
                R = r + GAMMA * R
                ob_returns.insert(0, R)
            returns.extend(ob_returns)
            log_probs.extend(self.saved_log_probs[ob_id])
            total += sum(self.rewards[ob_id])
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        loss = -(torch.stack(log_probs) * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return total


def run(world_size):
    agent = Agent(world_size)
    rewards = []
    for episode in range(EPISODES):
        agent.run_episode(STEPS)
        total = agent.finish_episode()
        rewards.append(total)
        print(f"Episode {episode}\tLast reward: {total:.0f}")
    params = torch.cat([p.detach().flatten() for p in agent.policy.parameters()])
    return {
        "episode_rewards": rewards,
        "checksum": params.sum().item(),
        "parameters": params.tolist(),
        "observers": [(ob.owner().name, ob.owner().id) for ob in agent.ob_rrefs],
    }


# --- launcher (not pasted) ---

if __name__ == "__main__":
    from launch import main

    main(run, WORLD_SIZE)
