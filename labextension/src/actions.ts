/**
 * The panel's actions: the buttons a live group shows, and running one through the kernel
 * (its reply shown in the panel's note; "open" adds a cell with the magic and runs it).
 */

import { NotebookActions } from '@jupyterlab/notebook';

import { ActionArgs, Link } from './comm';

/** The buttons under a live group, in order. */
export const GROUP_ACTIONS: {
  label: string;
  action: string;
  args: ActionArgs;
}[] = [
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
  note.textContent = `${action}...`;
  const reply = await link.act(action, args);
  note.textContent = reply.message ?? '';
  note.classList.toggle('rpcnb-panel-error', !reply.ok);
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
