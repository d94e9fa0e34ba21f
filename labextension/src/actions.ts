/**
 * The panel's actions: the buttons a live group shows, and running one through the kernel
 * (its reply shown in the panel's note; "open" adds a cell with the magic and runs it).
 */

import { NotebookActions } from '@jupyterlab/notebook';

import { ActionArgs, Link } from './comm';
import { pendingText } from './model';

/** Put ``text`` on the clipboard: the Clipboard API where the page may use it, else a
 * selected textarea and the copy command. */
async function copyText(text: string): Promise<boolean> {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (err) {
    const area = document.createElement('textarea');
    area.value = text;
    document.body.append(area);
    area.select();
    const ok = document.execCommand('copy');
    area.remove();
    return ok;
  }
}

/** The buttons under a live group, in order. */
export const GROUP_ACTIONS: {
  label: string;
  action: string;
  args: ActionArgs;
}[] = [
  { label: 'Add a worker', action: 'add', args: { n: 1 } },
  { label: 'Copy join line', action: 'join', args: {} },
  { label: 'Probe', action: 'probe', args: {} },
  { label: 'Channel monitor', action: 'open', args: { what: 'channels' } },
  { label: 'Device maps', action: 'open', args: { what: 'devmap' } },
  { label: 'Shut down', action: 'shutdown', args: {} }
];

/** Ask the kernel for ``action``; say its answer in ``note``. */
export async function runAction(
  link: Link,
  note: HTMLElement,
  action: string,
  args: ActionArgs = {}
): Promise<void> {
  const snap = link.conn.state === 'live' ? link.conn.snapshot : null;
  note.textContent = pendingText(action, Boolean(snap?.busy), snap?.waits);
  note.classList.remove('rpcnb-panel-error');
  const reply = await link.act(action, args);
  note.textContent = reply.message ?? '';
  note.classList.toggle('rpcnb-panel-error', !reply.ok);
  if (reply.text) {
    // "stacks": the member's threads, as %rpc_stacks prints them
    const block = document.createElement('pre');
    block.className = 'rpcnb-panel-text';
    block.textContent = reply.text;
    note.append(block);
  }
  if (reply.ok && reply.copy !== undefined && !(await copyText(reply.copy))) {
    note.textContent = `copy this line by hand: ${reply.copy}`;
  }
  const nb = link.notebookPanel;
  if (reply.ok && reply.insert && nb) {
    // "open": a cell with the magic, added at the end of the notebook and run
    const model = nb.content.model;
    if (model) {
      model.sharedModel.insertCell(model.cells.length, {
        cell_type: 'code',
        source: reply.insert
      });
      nb.content.activeCellIndex = model.cells.length - 1;
      await NotebookActions.run(nb.content, nb.sessionContext);
    }
  }
}
